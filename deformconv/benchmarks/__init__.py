"""The benchmarks behind ``python -m deformconv benchmark`` and ``benchmark-training``:

    shapes       the shapes timed and their operands
    contenders   what deformconv is timed against
    timing       medians of interleaved repeats, peak memory, copy bandwidth, a busy core
    environment  the CPU, its vector ISA and the kernels the contenders run there
    run          one shape's report, and the scaling report
    report       the printed report, the chart, and the tables of docs/performance.md
    cli          ``python -m deformconv benchmark``
    training     ``python -m deformconv benchmark-training``
"""
