/*
 * The DLPack ABI (https://dmlc.github.io/dlpack/latest/), written for colibri from
 * the specification (version 1.1, and 1.2's C exchange API): the structs a producer hands over in a
 * "dltensor" / "dltensor_versioned" capsule. Plain C: usable without colibri.
 */
#ifndef COLIBRI_DLPACK_H
#define COLIBRI_DLPACK_H

#include <stdint.h>

#define COLIBRI_DLPACK_MAJOR 1
#define COLIBRI_DLPACK_MINOR 1

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,
    kDLCUDAManaged = 13,
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6
    /* 7..17: fp8 / fp6 / fp4 variants (DLPack 1.1), rejected by colibri */
} DLDataTypeCode;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means C-contiguous */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

#define DLPACK_FLAG_BITMASK_READ_ONLY (1ULL << 0)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1ULL << 1)
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (1ULL << 2)

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/*
 * DLPack 1.2+ C exchange API: a framework publishes a static table of these functions on
 * its tensor type (`__dlpack_c_exchange_api__` as a "dlpack_exchange_api" capsule, or
 * `__c_dlpack_exchange_api__` as an int), so a consumer can read and create tensors
 * without a Python-level `__dlpack__` round trip.
 */
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
    DLPackExchangeAPIHeader header;
    int (*managed_tensor_allocator)(DLTensor *prototype, DLManagedTensorVersioned **out,
                                    void *error_ctx,
                                    void (*SetError)(void *error_ctx, const char *kind,
                                                     const char *message));
    int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
    int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor,
                                               void **out_py_object);
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out); /* may be NULL */
    int (*current_work_stream)(DLDeviceType device_type, int32_t device_id,
                               void **out_current_stream);
} DLPackExchangeAPI;

#endif /* COLIBRI_DLPACK_H */
