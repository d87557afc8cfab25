"""`eyas doctor`: a training log of any tool read into facts, series and figures, then judged.
"""
