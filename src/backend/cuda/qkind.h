/*
 * The GGUF block types the CUDA backend keeps quantised on the device (qweight.h has their
 * layout), as one small header that the C files and the .cu files both include.
 */
#ifndef TANDEM_BACKEND_CUDA_QKIND_H
#define TANDEM_BACKEND_CUDA_QKIND_H

/* 0: none (the matrix is held as bf16) */
enum tdm_cu_qkind {
    TDM_CU_Q_NONE = 0,
    TDM_CU_Q8_0,
    TDM_CU_Q4_0,
    TDM_CU_Q4_1,
    TDM_CU_Q4_K,
    TDM_CU_Q6_K
};

#endif /* TANDEM_BACKEND_CUDA_QKIND_H */
