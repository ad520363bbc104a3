package main

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"time"
)

// syslogPath is where --syslog sends its datagrams.
// GOVIRTIOFSD_SYSLOG_SOCKET overrides it; it exists for the tests, which
// listen on a socket of their own (a test machine may run no syslog daemon).
func syslogPath() string {
	if p := os.Getenv("GOVIRTIOFSD_SYSLOG_SOCKET"); p != "" {
		return p
	}
	return "/dev/log"
}

// dialSyslog connects to the syslog socket. It is called at start-up,
// before anything could take /dev/log out of reach (a sandbox's
// pivot_root); the connection is then the only way out, and is carried
// along as it is (the sandbox can pass it on with (*net.UnixConn).File).
func dialSyslog(path string) (*net.UnixConn, error) {
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		return nil, fmt.Errorf("syslog %s: %w", path, err)
	}
	return c, nil
}

// syslogHandler is a slog.Handler that sends one RFC 3164-style datagram
// per record, as glibc's syslog(3) does:
//
//	<PRI>Mmm dd hh:mm:ss IDENT[PID]: msg="..." key=value ...
//
// with facility daemon and the severity of the record's level. The text
// after the header is slog's text format without time and level.
type syslogHandler struct {
	w     *syslogWriter
	inner slog.Handler // writes into w.buf
}

// syslogWriter is shared by a handler and its WithAttrs/WithGroup copies.
type syslogWriter struct {
	mu    sync.Mutex
	conn  net.Conn
	ident string
	pid   int
	buf   bytes.Buffer
}

// Write collects the text handler's output into the datagram being built.
func (w *syslogWriter) Write(p []byte) (int, error) { return w.buf.Write(p) }

const logDaemon = 3 << 3 // LOG_DAEMON

// syslogSeverity maps a slog level to a syslog(3) priority.
func syslogSeverity(l slog.Level) int {
	switch {
	case l >= slog.LevelError:
		return 3 // LOG_ERR
	case l >= slog.LevelWarn:
		return 4 // LOG_WARNING
	case l >= slog.LevelInfo:
		return 6 // LOG_INFO
	}
	return 7 // LOG_DEBUG
}

func newSyslogHandler(conn net.Conn, ident string, level slog.Leveler) *syslogHandler {
	w := &syslogWriter{conn: conn, ident: ident, pid: os.Getpid()}
	inner := slog.NewTextHandler(w, &slog.HandlerOptions{
		Level: level,
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) == 0 && (a.Key == slog.TimeKey || a.Key == slog.LevelKey) {
				return slog.Attr{} // in the header
			}
			return a
		},
	})
	return &syslogHandler{w: w, inner: inner}
}

func (h *syslogHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.inner.Enabled(ctx, l)
}

func (h *syslogHandler) Handle(ctx context.Context, r slog.Record) error {
	w := h.w
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Reset()
	t := r.Time
	if t.IsZero() {
		t = time.Now()
	}
	b := w.buf.AvailableBuffer()
	b = append(b, '<')
	b = strconv.AppendInt(b, int64(logDaemon|syslogSeverity(r.Level)), 10)
	b = append(b, '>')
	b = t.AppendFormat(b, time.Stamp)
	b = append(b, ' ')
	b = append(b, w.ident...)
	b = append(b, '[')
	b = strconv.AppendInt(b, int64(w.pid), 10)
	b = append(b, "]: "...)
	w.buf.Write(b)
	if err := h.inner.Handle(ctx, r); err != nil {
		return err
	}
	msg := bytes.TrimSuffix(w.buf.Bytes(), []byte("\n"))
	_, err := w.conn.Write(msg)
	return err
}

func (h *syslogHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &syslogHandler{w: h.w, inner: h.inner.WithAttrs(as)}
}

func (h *syslogHandler) WithGroup(name string) slog.Handler {
	return &syslogHandler{w: h.w, inner: h.inner.WithGroup(name)}
}
