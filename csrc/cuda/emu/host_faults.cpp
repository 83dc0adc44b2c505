// Host-logic scenarios for the fixes of the review (placeholder filled below).
#include "host_util.h"
