// The zstd filter as an HDF5 dynamic plugin, so that h5dump, h5ls and other HDF5 programs read
// dynaprobe dumps: HDF5_PLUGIN_PATH=<dir of libdynaprobe_h5zstd.so> h5dump step_00000000.h5
#include <H5PLextern.h>

extern "C" const H5Z_class2_t kDynaprobeZstdFilterClass;

extern "C" H5PL_type_t H5PLget_plugin_type(void) { return H5PL_TYPE_FILTER; }
extern "C" const void* H5PLget_plugin_info(void) { return &kDynaprobeZstdFilterClass; }
