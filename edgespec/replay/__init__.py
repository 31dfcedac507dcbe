"""Offline replay: recorded answers run again through the real engine on a
backend that charges each decode a modelled cost (simulator.py), and the
type check that both backends keep backend/protocol.py's interface
(conformance.py).  It sits above the engine and the drafters, which it
drives; `edgespec replay` is its command-line front end."""
