"""Benchmarks: each module ``bench/<topic>.py`` exposes ``main(quick: bool) -> None`` and prints
its figures side by side (ratios measured in one run, so machine noise cancels)."""
