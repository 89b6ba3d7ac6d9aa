"""``bimetal bench ladder``: tokens/s of the debug model on a 2-node lab, step by step up the transport ladder.

(Work in progress by engineer D, second session; see the module once complete.)
"""
