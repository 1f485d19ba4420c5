"""Transport adapters: the NIXL agent interface and its real implementation, the ZMQ side channel
and in-process directory for handshakes, and HMAC authentication.
"""
