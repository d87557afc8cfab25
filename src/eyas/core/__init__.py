"""What every stage stands on: settings and the CLI generated from them, errors, console output, paths, the
distributed environment, memory, target models and the batched decoder.
"""
