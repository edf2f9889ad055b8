"""colibri: Mixture-of-Experts routing and expert paging for machines too small for the model."""

from colibri._core import max_threads, openmp_enabled
from colibri.pager import BudgetError, Pager

__version__ = "0.1.0"

__all__ = ["BudgetError", "Pager", "__version__", "max_threads", "openmp_enabled"]
