"""The engine-facing API: the scheduler and worker halves a serving engine embeds, the outbox they
collect results from, and the rank runtime that starts and supervises the actors.
"""
