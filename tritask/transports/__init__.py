"""Transports: bytes in, one request and a reply channel out."""
