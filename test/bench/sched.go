package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Sched is the kernel scheduler's account of a set of processes' threads,
// summed: what a request costs beside its CPU time. Run and Wait come from
// /proc/PID/task/TID/schedstat (time on a CPU; time runnable but waiting
// for one: the run-queue delay a wake-up adds), the counts from
// /proc/PID/task/TID/sched. A thread that exits between two readings is
// missing from the later one, so a difference counts only threads alive at
// both: the daemons' serving threads are.
type Sched struct {
	Run, Wait              time.Duration
	Voluntary, Involuntary int64 // context switches: slept; preempted
	Migrations             int64 // moves to another CPU
	Threads                int
}

// Sub is the difference s - o.
func (s Sched) Sub(o Sched) Sched {
	return Sched{Run: s.Run - o.Run, Wait: s.Wait - o.Wait, Voluntary: s.Voluntary - o.Voluntary,
		Involuntary: s.Involuntary - o.Involuntary, Migrations: s.Migrations - o.Migrations, Threads: s.Threads}
}

// PerOp formats s per operation: context switches (voluntary +
// involuntary), migrations and run-queue wait.
func (s Sched) PerOp(ops int64) string {
	n := float64(max(ops, 1))
	return fmt.Sprintf("%.2f+%.2f / %.2f / %.1fµs", float64(s.Voluntary)/n, float64(s.Involuntary)/n,
		float64(s.Migrations)/n, s.Wait.Seconds()*1e6/n)
}

// ProcessSched sums Sched over every thread of pids.
func ProcessSched(pids []int) Sched {
	var s Sched
	for _, pid := range pids {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
		for _, t := range tasks {
			b, err := os.ReadFile(t + "/schedstat")
			if err != nil {
				continue
			}
			f := strings.Fields(string(b))
			if len(f) < 2 {
				continue
			}
			run, _ := strconv.ParseInt(f[0], 10, 64)
			wait, _ := strconv.ParseInt(f[1], 10, 64)
			s.Run += time.Duration(run)
			s.Wait += time.Duration(wait)
			s.Threads++
			b, err = os.ReadFile(t + "/sched")
			if err != nil {
				continue
			}
			procFields(b, func(k string, n int64) {
				switch k {
				case "nr_voluntary_switches":
					s.Voluntary += n
				case "nr_involuntary_switches":
					s.Involuntary += n
				case "se.nr_migrations":
					s.Migrations += n
				}
			})
		}
	}
	return s
}
