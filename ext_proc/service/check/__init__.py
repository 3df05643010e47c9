"""`gorgo check`: one look at every backend before `serve`, made with the running router's
own readers (probes.py, kv.py), judged into what will be precise and what approximate and
every problem with its fix (judge.py; each aspect of a backend: aspects.py; the verdict's
values: verdict.py), printed for people or as JSON (report.py); and the
commands `check` and `config-schema` (command.py).
"""
