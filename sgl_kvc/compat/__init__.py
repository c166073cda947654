"""Compatibility shims between SGLang 0.5.23 and the machines it runs on."""
