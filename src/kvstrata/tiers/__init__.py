"""Tiers: one interface, many media (host DRAM slab, local disk; remote later). No policy here."""
