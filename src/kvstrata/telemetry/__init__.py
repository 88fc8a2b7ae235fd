"""kvstrata.telemetry"""
