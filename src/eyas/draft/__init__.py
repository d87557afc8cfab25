"""The EAGLE-3 draft: its model, training-time test, vocabulary, checkpoints, and export to / import from the
engines' formats.
"""
