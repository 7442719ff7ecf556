"""Activation offloading: ``offloader`` (:class:`ActivationOffloader`, its lifecycle and plan) over
``host_copies`` (pinned host buffers and the device<->host copies of one group of saved activations).
"""
