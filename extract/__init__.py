"""Stage 1: stimuli generators, model adapters, tap hooks and the one-shot extraction runner.

The only stage that loads a vision-language model.
"""
