"""Measured comparisons of nxd_lc against reference implementations (not tests); see benchmarks/README.md."""
