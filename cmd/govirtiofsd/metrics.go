package main

import (
	"bufio"
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
	if p, ok := strings.CutPrefix(addr, "unix:"); ok {
		network, address = "unix", p
	} else if strings.HasPrefix(addr, "/") {
		network = "unix"
	}
	if network == "unix" {
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

// metricsSource is everything a scrape reads.
type metricsSource struct {
	fuse    *fuse.Server
	backend *vhostuser.Backend
	fs      *passthrough.FS
}

func (m *metricsSource) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/metrics" && r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	bw := bufio.NewWriter(w)
	m.fuse.WriteMetrics(bw)
	m.backend.WriteMetrics(bw)
	inodes, handles := m.fs.OpenCounts()
	fmt.Fprintf(bw, "# HELP govirtiofsd_open_inodes Inodes the guest holds (looked up and not forgotten), the root included.\n# TYPE govirtiofsd_open_inodes gauge\ngovirtiofsd_open_inodes %d\n", inodes)
	fmt.Fprintf(bw, "# HELP govirtiofsd_open_handles Open file and directory handles.\n# TYPE govirtiofsd_open_handles gauge\ngovirtiofsd_open_handles %d\n", handles)
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
		if err := srv.Serve(ln); err != nil && err != http.ErrServerClosed {
			log.Warn("metrics server stopped", "err", err)
		}
	}()
}
