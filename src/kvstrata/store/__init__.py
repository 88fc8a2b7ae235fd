"""The tiered store: lookup across tiers, promotion/demotion, write policies, quotas, eviction."""
