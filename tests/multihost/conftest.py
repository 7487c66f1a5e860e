"""Tests with ranks on separate hosts: network namespaces made by :mod:`tests.netns` (root and
iproute2, else they skip)."""

from tests.netns import netns_hosts

__all__ = ["netns_hosts"]
