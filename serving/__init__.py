"""Fathom's serving side: vLLM replica options and launch (`vllm`), supervision (`supervisor`),
routing and proxying (`router`, `gateway`, `requests`, `errors`), metrics (`metrics`).

Importable without django, platform or torch: the control plane and a bare replica host use it.
"""
