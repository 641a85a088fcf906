"""Placeholder until written."""


def register(sub, name):
    pass
