"""Drafter models: Medusa heads, EAGLE-1/2 and EAGLE-3 drafters, their formats and exports."""
