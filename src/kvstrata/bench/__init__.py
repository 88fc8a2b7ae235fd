"""kvstrata.bench"""
