/*
 * The self drafter: the target's first N layers, then its final norm and LM head, run by the
 * chain machinery (chain.c) on the target's own engine with an early exit (tdm_engine_out
 * .n_layers = N). Each pass writes layers [0, N) of the request's own pages at the drafted
 * positions, which the scheduler reserved; the verify pass writes every layer there, so what
 * is kept is the target's own KV, and there is nothing to catch up on.
 *
 * Ownership: borrows the target engine. Scheduler thread.
 */
#include "spec/spec_int.h"

tdm_status tdm_spec_self_create(tdm_engine_t *target, int n_layers, enum tdm_spec_accept accept,
                                bool one_hot, struct tdm_spec_drafter *out)
{
    int L = tdm_engine_model(target)->cfg.n_layers;
    if (n_layers <= 0) n_layers = TDM_MAX(1, L / 4);
    if (n_layers > L) /* N = L: the model drafting for itself, the upper bound of acceptance */
        return tdm_err_set(TDM_EINVAL, "spec self: --spec-self-layers %d: the model has %d layers",
                           n_layers, L);
    return tdm_spec_chain_create(target, false, n_layers, false, "self", accept, one_hot, out);
}
