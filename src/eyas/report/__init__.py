"""`eyas report`: a run folder's self-contained HTML report, its sections and plots.
"""
