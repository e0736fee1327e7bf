/* mhaspec's compiled chunk loops: see common.h. */
#include "common.h"
