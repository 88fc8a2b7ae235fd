"""kvstrata.serve"""
