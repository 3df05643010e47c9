"""The cost terms, one module each (`vocab.terms` says what a term is): what each candidate
backend would cost a request, computed from the inputs the framework gathers once per
backend (`base.TermInputs`). `catalog` imports the built-in ones in their order. May
import: what `core` may.
"""
