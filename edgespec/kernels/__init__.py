"""Numba kernels: pure functions over contiguous numpy arrays.

Every kernel writes its results into arrays preallocated by the caller and
returns how many entries it wrote, so that the hot path allocates nothing in
Python.
"""
