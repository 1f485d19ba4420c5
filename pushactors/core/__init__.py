"""The core: configuration, KV blocks and head slices, request identity, and the plain request
state (registries, ledgers) the actors keep.
"""
