"""Vendor detection, rank records, NIC discovery and the topology exchange (JSON over the c10d store)."""
