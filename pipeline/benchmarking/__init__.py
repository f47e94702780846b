"""The benchmark stage's parts (pipeline/stages/benchmark.py runs them):

    setups.py    what one measurement is (variant x backend x setting x threads) and which ones this machine runs
    worker.py    one setup measured in its own interpreter (`python -m pipeline.benchmarking.worker`)
    choice.py    the setup the server runs: the fastest that agrees with its variant; the interleaved headline rounds
    roofline.py  the machine's fp32 sgemm rate, the per-variant table's roofline
    report.py    reports/benchmark/: report.json, table.md, results.csv, metrics.json, throughput.png; `pipeline compare`
    profile.py   reports/benchmark/profile.txt: where the chosen setup spends its time

What differs by backend comes from its record in pipeline.runtimes.RUNTIME_BACKENDS: nothing here names one.
"""
