"""kvstrata.workloads"""
