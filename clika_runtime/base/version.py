"""The library's version: written into every graph, part of every cache key."""

VERSION = "0.3.0"
