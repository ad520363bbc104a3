package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/pflag"
)

// Options is the daemon's configuration, filled in from either flag dialect:
// the Rust virtiofsd's long options (--shared-dir DIR) and the C
// virtiofsd's -o options (-o source=DIR, libvirt's comma-joined
// -o source=DIR,cache=none). Both dialects write through the same option
// table in command-line order, so for single-valued options the last one
// given wins, whatever its spelling.
type Options struct {
	SharedDir         string
	SocketPath        string
	FD                int
	Queues            int
	Tag               string
	LogLevel          string
	PrintCapabilities bool
	Version           bool
	Foreground        bool

	// File system (internal/passthrough).
	Cache             string
	Timeout           string
	Writeback         bool
	Xattr             bool
	XattrMap          string
	PosixACL          bool
	SecurityLabel     bool
	AnnounceSubmounts bool
	NoReaddirplus     bool
	AllowDirectIO     bool
	KillprivV2        bool
	InodeFileHandles  string
	PosixLock         bool
	Flock             bool
	ReadOnly          bool
	PreserveNoatime   bool
	RlimitNofile      int
	ThreadPoolSize    int

	// MetricsAddr serves Prometheus metrics: HOST:PORT, or unix:PATH.
	MetricsAddr string

	// Sandbox (internal/sandbox).
	Sandbox string
	Seccomp string
	Modcaps string
	UIDMaps []string
	GIDMaps []string
}

// optKind says how an option's value is parsed.
type optKind int

const (
	optString optKind = iota
	optInt
	optBool
)

// option describes one setting and its spellings.
type option struct {
	long  string // Rust-style long flag, "" if none
	short string // one-letter flag, "" if none
	oKey  string // C-style -o key, "" if none
	kind  optKind
	usage string
	set   func(o *Options, v string) error
}

func setString(p func(*Options) *string) func(*Options, string) error {
	return func(o *Options, v string) error { *p(o) = v; return nil }
}

func setInt(p func(*Options) *int) func(*Options, string) error {
	return func(o *Options, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Errorf("%q is not a number", v)
		}
		*p(o) = n
		return nil
	}
}

func setBool(p func(*Options) *bool) func(*Options, string) error {
	return func(o *Options, v string) error {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return fmt.Errorf("%q is not a boolean", v)
		}
		*p(o) = b
		return nil
	}
}

// optionTable lists every option the daemon understands.
var optionTable = []option{
	{long: "shared-dir", oKey: "source", kind: optString, usage: "shared directory path",
		set: setString(func(o *Options) *string { return &o.SharedDir })},
	{long: "socket-path", kind: optString, usage: "vhost-user socket path to create and listen on",
		set: setString(func(o *Options) *string { return &o.SocketPath })},
	{long: "socket", kind: optString, usage: "deprecated alias of --socket-path",
		set: setString(func(o *Options) *string { return &o.SocketPath })},
	{long: "fd", kind: optInt, usage: "serve an inherited, already listening socket fd",
		set: setInt(func(o *Options) *int { return &o.FD })},
	{long: "queues", kind: optInt, usage: "number of request queues to advertise (GET_QUEUE_NUM answers 1 + N)",
		set: setInt(func(o *Options) *int { return &o.Queues })},
	{long: "tag", kind: optString, usage: "file system tag for the device config (enables the CONFIG protocol feature)",
		set: setString(func(o *Options) *string { return &o.Tag })},
	{long: "log-level", oKey: "log_level", kind: optString, usage: "error, warn, info, debug, trace or off",
		set: setString(func(o *Options) *string { return &o.LogLevel })},
	{long: "print-capabilities", kind: optBool, usage: "print the vhost-user capabilities JSON and exit",
		set: setBool(func(o *Options) *bool { return &o.PrintCapabilities })},
	{long: "version", short: "V", kind: optBool, usage: "print the version and exit",
		set: setBool(func(o *Options) *bool { return &o.Version })},
	{long: "cache", oKey: "cache", kind: optString, usage: "cache mode: never, metadata, auto or always (-o cache=none|auto|always)",
		set: setString(func(o *Options) *string { return &o.Cache })},
	{oKey: "timeout", kind: optString, usage: "entry and attribute timeout in seconds (C daemon)",
		set: setString(func(o *Options) *string { return &o.Timeout })},
	{long: "writeback", oKey: "writeback", kind: optBool, usage: "enable the guest's writeback cache",
		set: setBool(func(o *Options) *bool { return &o.Writeback })},
	{long: "xattr", oKey: "xattr", kind: optBool, usage: "enable extended attributes",
		set: setBool(func(o *Options) *bool { return &o.Xattr })},
	{long: "xattrmap", oKey: "xattrmap", kind: optString, usage: "xattr name mapping rules (the C daemon's syntax)",
		set: setString(func(o *Options) *string { return &o.XattrMap })},
	{long: "posix-acl", oKey: "posix_acl", kind: optBool, usage: "enable POSIX ACLs (implies --xattr)",
		set: setBool(func(o *Options) *bool { return &o.PosixACL })},
	{long: "security-label", oKey: "security_label", kind: optBool, usage: "accept security labels",
		set: setBool(func(o *Options) *bool { return &o.SecurityLabel })},
	{long: "announce-submounts", oKey: "announce_submounts", kind: optBool, usage: "tell the guest about host submounts (distinct st_dev)",
		set: setBool(func(o *Options) *bool { return &o.AnnounceSubmounts })},
	{long: "no-readdirplus", kind: optBool, usage: "do not use READDIRPLUS",
		set: setBool(func(o *Options) *bool { return &o.NoReaddirplus })},
	{oKey: "readdirplus", kind: optBool, usage: "use READDIRPLUS (-o no_readdirplus disables)",
		set: func(o *Options, v string) error {
			b, err := strconv.ParseBool(v)
			o.NoReaddirplus = !b
			return err
		}},
	{long: "allow-direct-io", oKey: "allow_direct_io", kind: optBool, usage: "honour the guest's O_DIRECT on host files",
		set: setBool(func(o *Options) *bool { return &o.AllowDirectIO })},
	{long: "killpriv-v2", oKey: "killpriv_v2", kind: optBool, usage: "enable FUSE_HANDLE_KILLPRIV_V2",
		set: setBool(func(o *Options) *bool { return &o.KillprivV2 })},
	{long: "inode-file-handles", kind: optString, usage: "never, prefer or mandatory",
		set: setString(func(o *Options) *string { return &o.InodeFileHandles })},
	{oKey: "posix_lock", kind: optBool, usage: "enable POSIX locks",
		set: setBool(func(o *Options) *bool { return &o.PosixLock })},
	{oKey: "flock", kind: optBool, usage: "enable flock locks",
		set: setBool(func(o *Options) *bool { return &o.Flock })},
	{long: "readonly", kind: optBool, usage: "share read-only",
		set: setBool(func(o *Options) *bool { return &o.ReadOnly })},
	{long: "preserve-noatime", kind: optBool, usage: "keep the guest's O_NOATIME",
		set: setBool(func(o *Options) *bool { return &o.PreserveNoatime })},
	{long: "rlimit-nofile", kind: optInt, usage: "set RLIMIT_NOFILE to N (0: leave it; default: raise to min(1000000, fs.nr_open))",
		set: setInt(func(o *Options) *int { return &o.RlimitNofile })},
	{long: "thread-pool-size", oKey: "thread_pool_size", kind: optInt, usage: "most requests served on worker threads at once (0: all inline; default: number of CPUs)",
		set: setInt(func(o *Options) *int { return &o.ThreadPoolSize })},
	{long: "metrics-addr", kind: optString, usage: "serve Prometheus metrics on HOST:PORT or unix:PATH (off by default)",
		set: setString(func(o *Options) *string { return &o.MetricsAddr })},
	{short: "f", kind: optBool, usage: "stay in the foreground (always the case)",
		set: setBool(func(o *Options) *bool { return &o.Foreground })},

	// Sandbox (internal/sandbox).
	{long: "sandbox", oKey: "sandbox", kind: optString, usage: "confinement: namespace (default), chroot or none",
		set: setString(func(o *Options) *string { return &o.Sandbox })},
	{long: "seccomp", oKey: "seccomp", kind: optString, usage: "action on a system call outside the allowlist: kill (default), log, trap or none",
		set: setString(func(o *Options) *string { return &o.Seccomp })},
	{long: "modcaps", oKey: "modcaps", kind: optString, usage: "change the kept capabilities, e.g. +sys_admin:-mknod",
		set: setString(func(o *Options) *string { return &o.Modcaps })},
	{long: "uid-map", kind: optString, usage: "user namespace uid map :namespace_uid:host_uid:count: (repeatable)",
		set: func(o *Options, v string) error { o.UIDMaps = append(o.UIDMaps, v); return nil }},
	{long: "gid-map", kind: optString, usage: "user namespace gid map :namespace_gid:host_gid:count: (repeatable)",
		set: func(o *Options, v string) error { o.GIDMaps = append(o.GIDMaps, v); return nil }},
}

// flagValue feeds one option's flag into the Options in command-line order.
type flagValue struct {
	o   *Options
	opt *option
	val string
}

func (f *flagValue) String() string { return f.val }
func (f *flagValue) Set(v string) error {
	f.val = v
	return f.opt.set(f.o, v)
}
func (f *flagValue) Type() string {
	switch f.opt.kind {
	case optInt:
		return "int"
	case optBool:
		return "bool"
	}
	return "string"
}

// oValue parses C-dialect -o arguments as they come.
type oValue struct {
	o    *Options
	seen []string
}

func (v *oValue) String() string { return strings.Join(v.seen, ",") }
func (v *oValue) Type() string   { return "options" }
func (v *oValue) Set(s string) error {
	v.seen = append(v.seen, s)
	for _, item := range splitOptions(s) {
		if err := applyO(v.o, item); err != nil {
			return err
		}
	}
	return nil
}

// splitOptions splits a comma-joined -o list; ",," is a comma inside a value
// (libvirt escapes commas in paths that way).
func splitOptions(s string) []string {
	var items []string
	var cur strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == ',' {
			if i+1 < len(s) && s[i+1] == ',' {
				cur.WriteByte(',')
				i++
				continue
			}
			items = append(items, cur.String())
			cur.Reset()
			continue
		}
		cur.WriteByte(s[i])
	}
	items = append(items, cur.String())
	return items
}

func applyO(o *Options, item string) error {
	if item == "" {
		return nil
	}
	key, val, hasVal := strings.Cut(item, "=")
	for i := range optionTable {
		opt := &optionTable[i]
		if opt.oKey == "" {
			continue
		}
		switch {
		case key == opt.oKey && opt.kind == optBool && !hasVal:
			return opt.set(o, "true")
		case key == "no_"+opt.oKey && opt.kind == optBool && !hasVal:
			return opt.set(o, "false")
		case key == opt.oKey && hasVal:
			if err := opt.set(o, val); err != nil {
				return fmt.Errorf("-o %s: %w", key, err)
			}
			return nil
		}
	}
	return fmt.Errorf("unknown option -o %s", item)
}

// registerFlags adds every option of the table, and -o, to fs.
func registerFlags(fs *pflag.FlagSet, o *Options) {
	for i := range optionTable {
		opt := &optionTable[i]
		if opt.long == "" && opt.short == "" {
			continue
		}
		fv := &flagValue{o: o, opt: opt}
		name := opt.long
		if name == "" {
			name = "short-" + opt.short
		}
		f := fs.VarPF(fv, name, opt.short, opt.usage)
		if opt.kind == optBool {
			f.NoOptDefVal = "true"
		}
		if opt.long == "" {
			f.Hidden = true
		}
		if opt.long == "socket" {
			f.Deprecated = "use --socket-path"
		}
	}
	fs.VarP(&oValue{o: o}, "options", "o", "C virtiofsd options: -o source=DIR,log_level=debug (repeatable, comma-joined)")
}
