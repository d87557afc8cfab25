"""Speculative decoding with a target: the decoding loop, the drafters, the target runners, and `eyas evaluate`
with its report.
"""
