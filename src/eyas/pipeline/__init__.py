"""The whole pipeline: stages run in order inside one run folder (`eyas run`), and `eyas demo`.
"""
