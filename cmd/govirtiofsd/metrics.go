package main

import (
	"bufio"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/govirtiofsd/govirtiofsd/internal/fuse"
	"github.com/govirtiofsd/govirtiofsd/internal/passthrough"
	"github.com/govirtiofsd/govirtiofsd/internal/vhostuser"
)

// listenMetrics binds the metrics address (--metrics-addr): HOST:PORT for
// TCP, unix:PATH (or an absolute path) for a unix socket. It runs before
// the sandbox closes: a port bound inside a new network namespace, or a
// path resolved inside the shared directory, would be out of the host's
// reach.
func listenMetrics(addr string) (net.Listener, error) {
	network, address := "tcp", addr
	if p := metricsSocketPath(addr); p != "" {
		network, address = "unix", p
		if st, err := os.Lstat(address); err == nil && st.Mode()&os.ModeSocket != 0 {
			os.Remove(address) // a stale socket from an earlier run
		}
	}
	ln, err := net.Listen(network, address)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr %s: %w", addr, err)
	}
	return ln, nil
}

// metricsSocketPath is the unix socket path of a --metrics-addr, or "" for
// a TCP address.
func metricsSocketPath(addr string) string {
	if p, ok := strings.CutPrefix(addr, "unix:"); ok {
		return p
	}
	if strings.HasPrefix(addr, "/") {
		return addr
	}
	return ""
}

// metricsSource is everything a scrape reads.
type metricsSource struct {
	server     *fuse.Server
	backend    *vhostuser.Backend
	fileSystem *passthrough.FS
}

func (m *metricsSource) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/metrics" && r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	bw := bufio.NewWriter(w)
	m.server.WriteMetrics(bw)
	m.backend.WriteMetrics(bw)
	inodes, handles := m.fileSystem.OpenCounts()
	fmt.Fprintf(bw, "# HELP govirtiofsd_open_inodes Inodes the guest holds (looked up and not forgotten), the root included.\n# TYPE govirtiofsd_open_inodes gauge\ngovirtiofsd_open_inodes %d\n", inodes)
	fmt.Fprintf(bw, "# HELP govirtiofsd_open_handles Open file and directory handles.\n# TYPE govirtiofsd_open_handles gauge\ngovirtiofsd_open_handles %d\n", handles)
	st, bst := m.fileSystem.Stats(), m.fileSystem.BudgetStats()
	fmt.Fprintf(bw, "# HELP govirtiofsd_inode_fds O_PATH fds held for inodes (the root's, file handle mounts' and requests' own included).\n# TYPE govirtiofsd_inode_fds gauge\ngovirtiofsd_inode_fds %d\n", st.InodeFDs)
	fmt.Fprintf(bw, "# HELP govirtiofsd_inode_fd_budget The most fds held by inodes held by fd before unused ones are evicted (--inode-fd-budget).\n# TYPE govirtiofsd_inode_fd_budget gauge\ngovirtiofsd_inode_fd_budget %d\n", bst.Budget)
	fmt.Fprintf(bw, "# HELP govirtiofsd_inodes_evicted Inodes held by fd whose fd is closed for the budget, reopened by name when needed.\n# TYPE govirtiofsd_inodes_evicted gauge\ngovirtiofsd_inodes_evicted %d\n", bst.Evicted)
	fmt.Fprintf(bw, "# HELP govirtiofsd_inode_reopens_total Evicted inodes reopened by name.\n# TYPE govirtiofsd_inode_reopens_total counter\ngovirtiofsd_inode_reopens_total %d\n", bst.Reopens)
	fmt.Fprintf(bw, "# HELP govirtiofsd_inode_stale_total Reopens that found the object gone or replaced on the host, answered ESTALE.\n# TYPE govirtiofsd_inode_stale_total counter\ngovirtiofsd_inode_stale_total %d\n", bst.Stale)
	fmt.Fprintf(bw, "# HELP govirtiofsd_goroutines Goroutines of the daemon.\n# TYPE govirtiofsd_goroutines gauge\ngovirtiofsd_goroutines %d\n", runtime.NumGoroutine())
	bw.Flush()
}

// serveMetrics answers scrapes on ln until the process exits.
func serveMetrics(ln net.Listener, src *metricsSource, log *slog.Logger) {
	srv := &http.Server{
		Handler:           src,
		ReadHeaderTimeout: 5 * time.Second,
		WriteTimeout:      10 * time.Second,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	go func() {
		// The listener closes when the daemon returns: not worth a warning.
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) && !errors.Is(err, net.ErrClosed) {
			log.Warn("metrics server stopped", "err", err)
		}
	}()
	log.Info("serving metrics", "addr", ln.Addr().String())
}
