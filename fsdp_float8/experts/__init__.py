"""Mixture-of-experts: the three grouped GEMMs and the expert modules."""
