"""Conversations: input formats, chat templates and loss masks, `eyas prepare`, and `eyas regenerate` (the
target's own answers, locally or through an OpenAI-compatible server).
"""
