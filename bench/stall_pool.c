/*
 * The stall that include/colibri/pool.h removes, in isolation: 64 Ki floats of work in two
 * chunks, run serially, in an OpenMP parallel region of two threads, and on the pool;
 * median, p90 and max of 3000 calls. Run it while the cores are busy (e.g. beside
 * `python -c "while 1: pass" & python -c "while 1: pass" &`):
 *
 *     gcc -O2 -fopenmp -pthread -I include bench/stall_pool.c -o /tmp/stall && /tmp/stall
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
#include "colibri/pool.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
static float *data; static volatile float sink[64];
#define N (1<<16)
static void chunk(void *arg, int32_t c){ int chunks=*(int*)arg; float s=0; for(int i=c*N/chunks;i<(c+1)*N/chunks;i++) s+=data[i]*data[i]; sink[c]=s; }
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(){ data=malloc(4*N); for(int i=0;i<N;i++) data[i]=i*1e-6f; int R=3000; double *t=malloc(8*R); int two=2, one=1;
  for(int mode=0;mode<3;mode++){ for(int r=0;r<R;r++){ double t0=now();
      if(mode==0) chunk(&one,0);
      else if(mode==1){
        #pragma omp parallel for num_threads(2) schedule(static)
        for(int c=0;c<2;c++) chunk(&two,c);
      } else colibri_pool_run(chunk,&two,2,2);
      t[r]=now()-t0; }
    qsort(t,R,8,cmp); printf("%-8s median %7.1f us  p90 %8.1f us  max %9.1f us\n", mode==0?"serial":mode==1?"openmp":"pool", t[R/2]*1e6, t[R*9/10]*1e6, t[R-1]*1e6); }
  return 0; }
