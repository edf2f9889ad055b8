"""What a decoding step read of its modules, compared again in one call.

A layer's step (:mod:`._decode`) reads once what its kernels take of its modules (weights'
memory, epsilons, colibri's states of them) and must know before every step that none of it
changed. :class:`Seen` keeps what it saw of each module and compares it anew: the objects
its ``__dict__`` names (its own forward, colibri's states), its weight's and bias's
parameters, the weight's memory, dtype and strides, the bias's memory and version, its
epsilon. The same comparisons in Python cost ~10 us a layer hot and ~25 us in a decoding
step, whose weights streaming through the caches evict the interpreter's; here ~3 us hot.
"""

cdef class Seen:
    """A snapshot of ``modules`` (``torch.nn.Module``) and the ``dtype`` a step computes in.

    Parameters
    ----------
    modules : tuple
        The modules a step reads.
    dtype : object
        The step's dtype (compared by identity: torch's dtypes are singletons).
    names : tuple of str
        Names in each module's ``__dict__`` whose objects the step depends on (compared by
        identity).
    watched : tuple
        Modules among ``modules`` whose plain attributes (:func:`scalars`) the step depends
        on too (a router's ``top_k``), compared by value.
    """

    cdef readonly tuple modules
    cdef readonly object dtype
    cdef tuple names
    cdef list seen  # per module: (__dict__, objects of names, _parameters, weight, ...)
    cdef tuple watched  # (module, its scalars) of the modules whose plain attributes count

    def __init__(self, tuple modules, dtype, tuple names, tuple watched=()):
        self.modules, self.dtype, self.names = modules, dtype, names
        self.seen = [_look(m.__dict__, names) for m in modules]
        self.watched = tuple([(m, scalars(m)) for m in watched])

    def same(self, dtype) -> bool:
        """Whether ``dtype`` and every module are as seen."""
        if dtype is not self.dtype:
            return False
        cdef Py_ssize_t i, j, n = len(self.names)
        cdef tuple s, objects
        cdef dict d, params
        for i in range(len(self.modules)):
            s = <tuple>self.seen[i]
            d = self.modules[i].__dict__
            if d is not s[0]:
                return False
            objects = <tuple>s[1]
            for j in range(n):
                if d.get(self.names[j]) is not objects[j]:
                    return False
            params = d.get("_parameters")
            if params is not s[2]:
                return False
            weight = bias = None
            if params is not None:
                weight, bias = params.get("weight"), params.get("bias")
            if weight is not s[3] or bias is not s[7]:
                return False
            if weight is not None and (weight.data_ptr() != s[4] or weight.dtype is not s[5]
                                       or weight.stride() != s[6]):
                return False
            if bias is not None and (bias.data_ptr() != s[8] or bias._version != s[9]):
                return False
            if d.get("variance_epsilon", d.get("eps")) != s[10]:
                return False
        for m, plain in self.watched:
            if scalars(m) != plain:
                return False
        return True


cpdef tuple scalars(module):
    """``(name, value)`` of ``module``'s plain attributes (numbers, strings, None, as its
    ``__dict__`` holds them; not ``training`` nor private ones): what a router's routing is
    configured from (its ``top_k``, ``norm_topk_prob``, scaling factor, groups)."""
    cdef dict d = module.__dict__
    cdef list found = []
    cdef str name
    for key, value in d.items():
        if not (value is None or type(value) is int or type(value) is float
                or type(value) is bool or type(value) is str):
            continue
        if type(key) is not str:
            continue
        name = <str>key
        if name == "training" or name.startswith("_"):
            continue
        found.append((name, value))
    return tuple(found)


cdef tuple _look(dict d, tuple names):
    """What :class:`Seen` keeps of a module whose ``__dict__`` is ``d``."""
    params = d.get("_parameters")
    weight = bias = None
    if params is not None:
        weight, bias = params.get("weight"), params.get("bias")
    return (
        d,
        tuple([d.get(name) for name in names]),
        params,
        weight,
        None if weight is None else weight.data_ptr(),
        None if weight is None else weight.dtype,
        None if weight is None else weight.stride(),
        bias,
        None if bias is None else bias.data_ptr(),
        None if bias is None else bias._version,
        d.get("variance_epsilon", d.get("eps")),
    )
