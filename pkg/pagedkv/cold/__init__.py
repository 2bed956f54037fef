"""Cold tier: KV blocks persisted to disk, restored fail-closed (cold-tier.md)."""
