"""Tool-use tasks: a ReTool-style code interpreter environment, ``retool:<math task>`` and ``arith_tool``."""
