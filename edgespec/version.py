"""The package version, in a module of its own: any module reads it without importing
the package (whose __init__ imports the API, which imports those modules)."""
__version__ = "0.1.0"
