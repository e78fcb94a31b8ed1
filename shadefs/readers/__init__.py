"""Who reads what: jobs, one epoch tracker per job, per-job reads, demand, pending reads.

Below `cache/` (the policies, the speculator and the fetch log read its state) and beside
`sampling/` (which counts the pending reads of the orders it builds). `part.Readers` is
the part the service builds; see docs/developer-notes.md, "The readers part".
"""
