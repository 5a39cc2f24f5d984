"""Measurements at rest: the results store (its files, lines and loader), the tidy table, pairing with a
baseline, what a comparison is called, and the statistics every verdict uses. Imports no torch; sits
below the sweep that writes stores, the planner that calibrates on them and the report, gate and claims
that read them (docs/architecture.md, "Layers")."""
