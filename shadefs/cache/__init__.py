"""Where a file's bytes are: the coordinator, the RAM and SSD tiers, staging, the policies."""
