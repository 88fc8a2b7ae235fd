"""kvstrata.engine"""
