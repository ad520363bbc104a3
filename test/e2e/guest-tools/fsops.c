// fsops: the file system calls busybox lacks, for the e2e guest scripts.
//
// Built on the host by guest.sh with `gcc -static -O2` and put in the
// initramfs as /usr/bin/fsops. Each subcommand makes its calls and prints one
// line on stdout: "ok", a number, a few key=value words, or the errno name of
// the call that failed (e.g. "EOPNOTSUPP"). The exit status is 0 whenever the
// calls could be made (even if one failed with an errno: the script compares
// the printed value); 2 means bad usage.
//
//   fsops excl PATH                         open(O_CREAT|O_EXCL|O_WRONLY, 0644)
//   fsops rename2 OLD NEW exchange|noreplace renameat2
//   fsops seek PATH data|hole OFFSET        lseek SEEK_DATA / SEEK_HOLE
//   fsops falloc PATH MODE OFFSET LEN       fallocate; MODE: 0, keep, punch, zero
//   fsops copy SRC OFF DST OFF LEN          copy_file_range (loops to LEN or EOF)
//   fsops copyonce SRC DST LEN              one copy_file_range of LEN bytes from offset 0 to
//                                           offset 0 (DST created): the count it returned
//   fsops idmap SRC DST ID                  an idmapped bind mount of SRC (a directory owned by
//                                           ID:ID, which root may then write) on DST: a user
//                                           namespace mapping ID to 0 (uid_map and gid_map
//                                           "ID 0 1"), open_tree(OPEN_TREE_CLONE),
//                                           mount_setattr(MOUNT_ATTR_IDMAP), move_mount; then, as
//                                           root, creates DST/idmap-file and DST/idmap-dir and
//                                           prints "ok mnt=U:G src=U:G" (owner of idmap-file
//                                           through DST, and through SRC: 0:0 and ID:ID), or the
//                                           errno name of the failed call
//   fsops syncfs PATH                       syncfs on an fd of PATH
//   fsops fsync PATH                        fsync + fdatasync
//   fsops tmpfile DIR LINK DATA             O_TMPFILE in DIR, write DATA, linkat to LINK
//   fsops setx PATH NAME VALUE [create|replace]  setxattr
//   fsops lsetx PATH NAME VALUE             lsetxattr (no follow)
//   fsops getx PATH NAME                    getxattr (size probe, then the value): the value
//   fsops lgetx PATH NAME                   the same with lgetxattr (no follow)
//   fsops getxsmall PATH NAME               getxattr into a 1-byte buffer (ERANGE expected)
//   fsops listx PATH                        listxattr (size probe, then the list): sorted
//                                           names joined by ',' ("-" if none)
//   fsops llistx PATH                       the same with llistxattr (no follow)
//   fsops rmx PATH NAME                     removexattr
//   fsops statx PATH                        statx(STATX_BASIC_STATS|STATX_BTIME)
//   fsops mkmany DIR N                      create DIR/f00000... (N files, O_EXCL)
//   fsops count DIR                         getdents64: entries without . and .., FNV-1a of sorted names
//   fsops unlinkopen PATH                   open, unlink, then read/write through the fd
//   fsops fifo PATH                         open a FIFO O_RDWR|O_NONBLOCK, write and read back
//   fsops chr PATH N                        read N bytes from a device node: "bytes=N zero=1"
//   fsops mtime PATH                        st_mtime and st_atime seconds
//   fsops lstatlist LIST                    lstat every path of LIST (one a line), as git status
//                                           lstat's every file of its index: "stat=N errors=E"
//                                           (N answered), each failure on stderr as
//                                           "fsops: lstat PATH: <strerror>" (busybox xargs
//                                           garbles long lists under TCG: it repeats and splices
//                                           names)
//   fsops ftrunc PATH SIZE                  ftruncate through an open fd
//   fsops fsyncdir PATH                     fsync on a directory fd
//   fsops mmap PATH shared|private|write    map the first page: "ok:<first 5 bytes>", or
//                                           write "MMAP!" through a shared mapping + msync
//   fsops daxattr PATH                      statx: "dax=0|1 size=N" (STATX_ATTR_DAX in stx_attributes:
//                                           the kernel serves the file through the DAX window)
//   fsops mapsh PATH                        map PATH MAP_SHARED read/write (its size at start, at
//                                           least one page) and run commands read from stdin, one
//                                           a line, each answered by one line on stdout:
//                                             r OFF N       the N bytes at OFF as text: "r:<bytes>"
//                                             w OFF TEXT    store TEXT at OFF: "ok"
//                                             s             msync(MS_SYNC) of the mapping: "ok"/errno
//                                             p OFF TEXT MS poll the mapping until TEXT is at OFF:
//                                                           "seen ms=T" or "timeout r:<bytes>"
//                                             q             unmap and exit: "bye"
//                                           an access that faults answers "SIGBUS" or "SIGSEGV"
//                                           (the command is abandoned; the mapping stays); "mapped
//                                           size=N" first, once every page has been read
//   fsops try OP ARGS...                    one call, "ok" or its errno; OP: mkdir DIR,
//                                           rmdir DIR, unlink PATH, open PATH, openw PATH,
//                                           opendir PATH, rename OLD NEW, link OLD NEW,
//                                           symlink TARGET PATH, readlink PATH, truncate PATH
//   fsops now                               CLOCK_MONOTONIC in ms
//   fsops gen SEED N                        N pseudo-random bytes (xorshift64*, same on every run) to stdout
//   fsops asuser UID GID CMD...             drop to UID:GID (no supplementary groups) and exec CMD
//   fsops churn DIR N SEED                  metadata churn (soak.sh): see do_churn; unlike the
//                                           others it checks itself and exits 1 on the first
//                                           failure, naming the call, the path and the errno
#define _GNU_SOURCE
#include <dirent.h>
#include <setjmp.h>
#include <grp.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/mount.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <linux/stat.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

static const char *ename(int e) {
	const char *n = strerrorname_np(e);
	return n ? n : "E?";
}

// fail prints the errno name of the failed call and exits 0.
static int fail(void) {
	printf("%s\n", ename(errno));
	return 0;
}

static int usage(void) {
	fprintf(stderr, "fsops: bad usage (see the comment at the top of fsops.c)\n");
	return 2;
}

static long long num(const char *s) { return strtoll(s, NULL, 0); }

static int cmpstr(const void *a, const void *b) {
	return strcmp(*(char *const *)a, *(char *const *)b);
}

static int do_excl(char **a) {
	int fd = open(a[0], O_CREAT | O_EXCL | O_WRONLY, 0644);
	if (fd < 0)
		return fail();
	close(fd);
	printf("ok\n");
	return 0;
}

static int do_rename2(char **a) {
	unsigned flags;
	if (!strcmp(a[2], "exchange"))
		flags = RENAME_EXCHANGE;
	else if (!strcmp(a[2], "noreplace"))
		flags = RENAME_NOREPLACE;
	else
		return usage();
	if (syscall(SYS_renameat2, AT_FDCWD, a[0], AT_FDCWD, a[1], flags) < 0)
		return fail();
	printf("ok\n");
	return 0;
}

static int do_seek(char **a) {
	int whence;
	if (!strcmp(a[1], "data"))
		whence = SEEK_DATA;
	else if (!strcmp(a[1], "hole"))
		whence = SEEK_HOLE;
	else
		return usage();
	int fd = open(a[0], O_RDONLY);
	if (fd < 0)
		return fail();
	off_t r = lseek(fd, num(a[2]), whence);
	if (r < 0)
		return fail();
	printf("%lld\n", (long long)r);
	return 0;
}

static int do_falloc(char **a) {
	int mode;
	if (!strcmp(a[1], "0"))
		mode = 0;
	else if (!strcmp(a[1], "keep"))
		mode = FALLOC_FL_KEEP_SIZE;
	else if (!strcmp(a[1], "punch"))
		mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
	else if (!strcmp(a[1], "zero"))
		mode = FALLOC_FL_ZERO_RANGE;
	else
		return usage();
	int fd = open(a[0], O_RDWR);
	if (fd < 0)
		return fail();
	if (fallocate(fd, mode, num(a[2]), num(a[3])) < 0)
		return fail();
	printf("ok\n");
	return 0;
}

static int do_copy(char **a) {
	int in = open(a[0], O_RDONLY);
	if (in < 0)
		return fail();
	int out = open(a[2], O_WRONLY | O_CREAT, 0644);
	if (out < 0)
		return fail();
	loff_t oin = num(a[1]), oout = num(a[3]);
	long long left = num(a[4]), done = 0;
	while (left > 0) {
		ssize_t n = copy_file_range(in, &oin, out, &oout, left, 0);
		if (n < 0)
			return fail();
		if (n == 0)
			break;
		done += n;
		left -= n;
	}
	printf("%lld\n", done);
	return 0;
}

static int do_copyonce(char **a) {
	int in = open(a[0], O_RDONLY);
	if (in < 0)
		return fail();
	int out = open(a[1], O_WRONLY | O_CREAT, 0644);
	if (out < 0)
		return fail();
	loff_t oin = 0, oout = 0;
	ssize_t n = copy_file_range(in, &oin, out, &oout, (size_t)num(a[2]), 0);
	if (n < 0)
		return fail();
	printf("%lld\n", (long long)n);
	return 0;
}

// writemap writes "ID 0 1" to /proc/PID/FILE.
static int writemap(pid_t pid, const char *file, const char *id) {
	char path[64], line[64];
	snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, file);
	int fd = open(path, O_WRONLY);
	if (fd < 0)
		return -1;
	int n = snprintf(line, sizeof line, "%s 0 1\n", id);
	int r = write(fd, line, n) == n ? 0 : -1;
	close(fd);
	return r;
}

static int do_idmap(char **a) {
	int p[2];
	if (pipe(p) < 0)
		return fail();
	pid_t pid = fork();
	if (pid < 0)
		return fail();
	if (pid == 0) {
		// The child holds a new user namespace until the parent closes
		// the pipe.
		char c;
		close(p[1]);
		if (unshare(CLONE_NEWUSER) < 0)
			_exit(1);
		(void)read(p[0], &c, 1);
		_exit(0);
	}
	close(p[0]);
	char nspath[64];
	snprintf(nspath, sizeof nspath, "/proc/%d/ns/user", (int)pid);
	int userns = -1, err = 0;
	const char *what = "";
	// Wait until the child is in its namespace (the link changes).
	char self[64] = "", cur[64] = "";
	readlink("/proc/self/ns/user", self, sizeof self - 1);
	for (int i = 0; i < 1000; i++) {
		memset(cur, 0, sizeof cur);
		if (readlink(nspath, cur, sizeof cur - 1) > 0 && strcmp(cur, self) != 0)
			break;
		usleep(1000);
	}
	if (writemap(pid, "uid_map", a[2]) < 0) {
		err = errno, what = "uid_map";
	} else if (writemap(pid, "gid_map", a[2]) < 0) {
		err = errno, what = "gid_map";
	} else if ((userns = open(nspath, O_RDONLY | O_CLOEXEC)) < 0) {
		err = errno, what = "userns";
	}
	close(p[1]);
	waitpid(pid, NULL, 0);
	if (err) {
		printf("%s %s\n", what, ename(err));
		return 0;
	}
	int tree = syscall(SYS_open_tree, AT_FDCWD, a[0], OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
	if (tree < 0) {
		printf("open_tree %s\n", ename(errno));
		return 0;
	}
	struct mount_attr attr = {.attr_set = MOUNT_ATTR_IDMAP, .userns_fd = (uint64_t)userns};
	if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0) {
		printf("mount_setattr %s\n", ename(errno));
		return 0;
	}
	if (syscall(SYS_move_mount, tree, "", AT_FDCWD, a[1], MOVE_MOUNT_F_EMPTY_PATH) < 0) {
		printf("move_mount %s\n", ename(errno));
		return 0;
	}
	char f[4096], d[4096], s[4096];
	snprintf(f, sizeof f, "%s/idmap-file", a[1]);
	snprintf(d, sizeof d, "%s/idmap-dir", a[1]);
	snprintf(s, sizeof s, "%s/idmap-file", a[0]);
	int fd = open(f, O_WRONLY | O_CREAT | O_EXCL, 0644);
	if (fd < 0) {
		printf("create %s\n", ename(errno));
		return 0;
	}
	if (write(fd, "idmap\n", 6) != 6) {
		printf("write %s\n", ename(errno));
		return 0;
	}
	close(fd);
	if (mkdir(d, 0755) < 0) {
		printf("mkdir %s\n", ename(errno));
		return 0;
	}
	struct stat mst, sst;
	if (stat(f, &mst) < 0 || stat(s, &sst) < 0)
		return fail();
	printf("ok mnt=%u:%u src=%u:%u\n", mst.st_uid, mst.st_gid, sst.st_uid, sst.st_gid);
	return 0;
}

static int do_syncfs(char **a) {
	int fd = open(a[0], O_RDONLY);
	if (fd < 0)
		return fail();
	if (syncfs(fd) < 0)
		return fail();
	printf("ok\n");
	return 0;
}

static int do_fsync(char **a) {
	int fd = open(a[0], O_RDWR);
	if (fd < 0)
		return fail();
	if (fsync(fd) < 0)
		return fail();
	if (fdatasync(fd) < 0)
		return fail();
	printf("ok\n");
	return 0;
}

static int do_tmpfile(char **a) {
	int fd = open(a[0], O_TMPFILE | O_RDWR, 0600);
	if (fd < 0) {
		printf("open=%s\n", ename(errno));
		return 0;
	}
	struct stat st;
	size_t len = strlen(a[2]);
	if (write(fd, a[2], len) != (ssize_t)len) {
		printf("open=ok write=%s\n", ename(errno));
		return 0;
	}
	if (fstat(fd, &st) < 0) {
		printf("open=ok write=ok fstat=%s\n", ename(errno));
		return 0;
	}
	long nlink0 = (long)st.st_nlink;
	char proc[64];
	snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
	if (linkat(AT_FDCWD, proc, AT_FDCWD, a[1], AT_SYMLINK_FOLLOW) < 0) {
		printf("open=ok write=ok nlink_before=%ld link=%s\n", nlink0, ename(errno));
		return 0;
	}
	if (fstat(fd, &st) < 0) {
		printf("open=ok write=ok nlink_before=%ld link=ok fstat=%s\n", nlink0, ename(errno));
		return 0;
	}
	printf("open=ok write=ok nlink_before=%ld link=ok nlink_after=%ld mode=%o size=%lld\n", nlink0,
	       (long)st.st_nlink, st.st_mode & 07777, (long long)st.st_size);
	return 0;
}

static int do_setx(char **a, int argc, int nofollow) {
	int flags = 0;
	if (argc > 3) {
		if (!strcmp(a[3], "create"))
			flags = XATTR_CREATE;
		else if (!strcmp(a[3], "replace"))
			flags = XATTR_REPLACE;
		else
			return usage();
	}
	int r = nofollow ? lsetxattr(a[0], a[1], a[2], strlen(a[2]), flags)
			 : setxattr(a[0], a[1], a[2], strlen(a[2]), flags);
	if (r < 0)
		return fail();
	printf("ok\n");
	return 0;
}

static int do_getx(char **a, int nofollow) {
	char buf[65536];
	ssize_t want = nofollow ? lgetxattr(a[0], a[1], NULL, 0) : getxattr(a[0], a[1], NULL, 0);
	if (want < 0)
		return fail();
	if (want >= (ssize_t)sizeof buf) {
		printf("size=%zd\n", want);
		return 0;
	}
	ssize_t n = nofollow ? lgetxattr(a[0], a[1], buf, want) : getxattr(a[0], a[1], buf, want);
	if (n < 0)
		return fail();
	if (n != want) {
		printf("probe=%zd got=%zd\n", want, n);
		return 0;
	}
	buf[n] = 0;
	if (n > 64) // long values: their length and a checksum of the bytes
	{
		unsigned sum = 0;
		for (ssize_t i = 0; i < n; i++)
			sum = sum * 31 + (unsigned char)buf[i];
		printf("len=%zd sum=%08x\n", n, sum);
		return 0;
	}
	printf("%s\n", buf);
	return 0;
}

static int do_getxsmall(char **a) {
	char buf[1];
	ssize_t n = getxattr(a[0], a[1], buf, sizeof buf);
	if (n < 0)
		return fail();
	printf("got=%zd\n", n);
	return 0;
}

static int do_listx(char **a, int nofollow) {
	char buf[65536];
	ssize_t want = nofollow ? llistxattr(a[0], NULL, 0) : listxattr(a[0], NULL, 0);
	if (want < 0)
		return fail();
	if (want > (ssize_t)sizeof buf) {
		printf("size=%zd\n", want);
		return 0;
	}
	ssize_t n = nofollow ? llistxattr(a[0], buf, want) : listxattr(a[0], buf, want);
	if (n < 0)
		return fail();
	if (n != want) {
		printf("probe=%zd got=%zd\n", want, n);
		return 0;
	}
	char *names[1024];
	int c = 0;
	for (char *p = buf; p < buf + n && c < 1024; p += strlen(p) + 1)
		names[c++] = p;
	qsort(names, c, sizeof names[0], cmpstr);
	if (c == 0)
		printf("-");
	for (int i = 0; i < c; i++)
		printf("%s%s", i ? "," : "", names[i]);
	printf("\n");
	return 0;
}

static int do_rmx(char **a) {
	if (removexattr(a[0], a[1]) < 0)
		return fail();
	printf("ok\n");
	return 0;
}

static int do_statx(char **a) {
	struct statx sx;
	memset(&sx, 0, sizeof sx);
	if (statx(AT_FDCWD, a[0], AT_SYMLINK_NOFOLLOW, STATX_BASIC_STATS | STATX_BTIME, &sx) < 0)
		return fail();
	int basic = (sx.stx_mask & STATX_BASIC_STATS) == STATX_BASIC_STATS;
	int btime = (sx.stx_mask & STATX_BTIME) != 0;
	// A plausible birth time: after 2020 and not after the change time.
	int btime_ok = btime && sx.stx_btime.tv_sec > 1577836800 && sx.stx_btime.tv_sec <= sx.stx_ctime.tv_sec;
	printf("basic=%d btime=%d btime_ok=%d mode=%o nlink=%u uid=%u gid=%u size=%llu blocks=%llu mtime=%lld\n",
	       basic, btime, btime_ok, sx.stx_mode, sx.stx_nlink, sx.stx_uid, sx.stx_gid,
	       (unsigned long long)sx.stx_size, (unsigned long long)sx.stx_blocks,
	       (long long)sx.stx_mtime.tv_sec);
	return 0;
}

static long long now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int do_mkmany(char **a) {
	long n = num(a[1]);
	char path[4096];
	for (long i = 0; i < n; i++) {
		snprintf(path, sizeof path, "%s/f%05ld", a[0], i);
		int fd = open(path, O_CREAT | O_EXCL | O_WRONLY, 0644);
		if (fd < 0) {
			printf("created=%ld %s\n", i, ename(errno));
			return 0;
		}
		close(fd);
	}
	printf("created=%ld\n", n);
	return 0;
}

struct linux_dirent64 {
	uint64_t d_ino;
	int64_t d_off;
	unsigned short d_reclen;
	unsigned char d_type;
	char d_name[];
};

static int do_count(char **a) {
	int fd = open(a[0], O_RDONLY | O_DIRECTORY);
	if (fd < 0)
		return fail();
	size_t cap = 1024, c = 0;
	char **names = malloc(cap * sizeof *names);
	char buf[32768];
	long calls = 0;
	for (;;) {
		long n = syscall(SYS_getdents64, fd, buf, sizeof buf);
		if (n < 0)
			return fail();
		if (n == 0)
			break;
		calls++;
		for (long off = 0; off < n;) {
			struct linux_dirent64 *d = (void *)(buf + off);
			off += d->d_reclen;
			if (!strcmp(d->d_name, ".") || !strcmp(d->d_name, ".."))
				continue;
			if (c == cap)
				names = realloc(names, (cap *= 2) * sizeof *names);
			names[c++] = strdup(d->d_name);
		}
	}
	qsort(names, c, sizeof *names, cmpstr);
	uint64_t h = 1469598103934665603ULL;
	for (size_t i = 0; i < c; i++) {
		for (const char *p = names[i]; *p; p++)
			h = (h ^ (unsigned char)*p) * 1099511628211ULL;
		h = (h ^ '/') * 1099511628211ULL;
	}
	printf("count=%zu fnv=%016llx\n", c, (unsigned long long)h);
	fprintf(stderr, "fsops count: %ld getdents64 calls\n", calls);
	return 0;
}

// churn: one round of metadata churn in DIR (which must not exist), checked
// as it goes: mkdir DIR and D = ceil(N/128) subdirectories; create N files
// (O_EXCL) holding 64-575 bytes derived from SEED and the file's number;
// rename each (even numbers into the next subdirectory, odd ones within
// their own); hard-link every 8th and symlink every 8th (offset 4); count
// each subdirectory with getdents64 (only the renamed names, the links and
// the symlinks); read every file back and compare, readlink every symlink;
// unlink everything, rmdir the subdirectories and DIR. Prints "files=N
// renamed= linked= symlinked= verified= unlinked= dirs= ms=" on success;
// otherwise "churn-error op=OP path=PATH errno=E" (or "got=G want=W", or
// "entry=NAME" for a listed name that was renamed away) and exits 1.
static char churn_path[4096], churn_path2[4096];

static int churn_fail(const char *op, const char *path) {
	printf("churn-error op=%s path=%s errno=%s\n", op, path, ename(errno));
	return 1;
}

static int churn_mismatch(const char *op, const char *path, long long got, long long want) {
	printf("churn-error op=%s path=%s got=%lld want=%lld\n", op, path, got, want);
	return 1;
}

// churn_data fills buf with file i's content and returns its length.
static size_t churn_data(unsigned char *buf, uint64_t seed, long i) {
	uint64_t x = (seed * 0x9E3779B97F4A7C15ULL) ^ ((uint64_t)i * 0xBF58476D1CE4E5B9ULL) ^ 1;
	size_t len = 64 + (size_t)(i * 37 % 512);
	for (size_t k = 0; k < len; k++) {
		x ^= x >> 12;
		x ^= x << 25;
		x ^= x >> 27;
		buf[k] = (unsigned char)((x * 0x2545F4914F6CDD1DULL) >> 56);
	}
	return len;
}

static const char *churn_name(char *out, const char *dir, long d, char kind, long i) {
	snprintf(out, 4096, "%s/d%03ld/%c%06ld", dir, d, kind, i);
	return out;
}

static int do_churn(char **a) {
	const char *dir = a[0];
	long n = num(a[1]), nd = (n + 127) / 128;
	uint64_t seed = (uint64_t)num(a[2]);
	long renamed = 0, linked = 0, symlinked = 0, verified = 0, unlinked = 0;
	unsigned char want[1024], got[1024];
	long long t0 = now_ms();
	if (n < 1)
		return usage();
	if (mkdir(dir, 0755) < 0)
		return churn_fail("mkdir", dir);
	for (long d = 0; d < nd; d++) {
		snprintf(churn_path, sizeof churn_path, "%s/d%03ld", dir, d);
		if (mkdir(churn_path, 0755) < 0)
			return churn_fail("mkdir", churn_path);
	}
	for (long i = 0; i < n; i++) {
		const char *p = churn_name(churn_path, dir, i % nd, 'c', i);
		int fd = open(p, O_CREAT | O_EXCL | O_WRONLY, 0644);
		if (fd < 0)
			return churn_fail("create", p);
		size_t len = churn_data(want, seed, i);
		ssize_t w = write(fd, want, len);
		if (w < 0)
			return churn_fail("write", p);
		if ((size_t)w != len)
			return churn_mismatch("write", p, w, len);
		if (close(fd) < 0)
			return churn_fail("close", p);
	}
	for (long i = 0; i < n; i++) {
		long to = i % 2 == 0 ? (i + 1) % nd : i % nd;
		churn_name(churn_path, dir, i % nd, 'c', i);
		churn_name(churn_path2, dir, to, 'r', i);
		if (rename(churn_path, churn_path2) < 0)
			return churn_fail("rename", churn_path);
		renamed++;
	}
	// File i now lives in subdirectory r(i); its links and symlinks next to it.
#define CHURN_DIR(i) ((i) % 2 == 0 ? ((i) + 1) % nd : (i) % nd)
	for (long i = 0; i < n; i++) {
		long d = CHURN_DIR(i);
		churn_name(churn_path, dir, d, 'r', i);
		if (i % 8 == 0) {
			churn_name(churn_path2, dir, d, 'l', i);
			if (link(churn_path, churn_path2) < 0)
				return churn_fail("link", churn_path2);
			linked++;
		} else if (i % 8 == 4) {
			churn_name(churn_path2, dir, d, 's', i);
			char target[32];
			snprintf(target, sizeof target, "r%06ld", i);
			if (symlink(target, churn_path2) < 0)
				return churn_fail("symlink", churn_path2);
			symlinked++;
		}
	}
	long entries = 0;
	for (long d = 0; d < nd; d++) {
		snprintf(churn_path, sizeof churn_path, "%s/d%03ld", dir, d);
		int fd = open(churn_path, O_RDONLY | O_DIRECTORY);
		if (fd < 0)
			return churn_fail("opendir", churn_path);
		char buf[32768];
		for (;;) {
			long r = syscall(SYS_getdents64, fd, buf, sizeof buf);
			if (r < 0)
				return churn_fail("getdents64", churn_path);
			if (r == 0)
				break;
			for (long off = 0; off < r;) {
				struct linux_dirent64 *e = (void *)(buf + off);
				off += e->d_reclen;
				if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
					continue;
				if (e->d_name[0] == 'c') { // a name renamed away is still listed
					printf("churn-error op=readdir path=%s entry=%s\n", churn_path, e->d_name);
					return 1;
				}
				entries++;
			}
		}
		close(fd);
	}
	if (entries != n + linked + symlinked)
		return churn_mismatch("readdir-count", dir, entries, n + linked + symlinked);
	for (long i = 0; i < n; i++) {
		long d = CHURN_DIR(i);
		const char *p = churn_name(churn_path, dir, d, 'r', i);
		size_t len = churn_data(want, seed, i);
		int fd = open(p, O_RDONLY);
		if (fd < 0)
			return churn_fail("open", p);
		ssize_t r = read(fd, got, sizeof got);
		if (r < 0)
			return churn_fail("read", p);
		close(fd);
		if ((size_t)r != len)
			return churn_mismatch("read-len", p, r, len);
		if (memcmp(got, want, len) != 0)
			return churn_mismatch("read-data", p, i, i);
		if (i % 8 == 4) {
			char target[32], buf[64];
			snprintf(target, sizeof target, "r%06ld", i);
			churn_name(churn_path2, dir, d, 's', i);
			ssize_t l = readlink(churn_path2, buf, sizeof buf - 1);
			if (l < 0)
				return churn_fail("readlink", churn_path2);
			buf[l] = 0;
			if (strcmp(buf, target) != 0)
				return churn_mismatch("readlink", churn_path2, l, (long long)strlen(target));
		}
		verified++;
	}
	for (long i = 0; i < n; i++) {
		long d = CHURN_DIR(i);
		const char *p = churn_name(churn_path, dir, d, 'r', i);
		if (unlink(p) < 0)
			return churn_fail("unlink", p);
		unlinked++;
		if (i % 8 == 0 || i % 8 == 4) {
			p = churn_name(churn_path, dir, d, i % 8 == 0 ? 'l' : 's', i);
			if (unlink(p) < 0)
				return churn_fail("unlink", p);
			unlinked++;
		}
	}
#undef CHURN_DIR
	for (long d = 0; d < nd; d++) {
		snprintf(churn_path, sizeof churn_path, "%s/d%03ld", dir, d);
		if (rmdir(churn_path) < 0)
			return churn_fail("rmdir", churn_path);
	}
	if (rmdir(dir) < 0)
		return churn_fail("rmdir", dir);
	printf("files=%ld renamed=%ld linked=%ld symlinked=%ld verified=%ld unlinked=%ld dirs=%ld ms=%lld\n", n,
	       renamed, linked, symlinked, verified, unlinked, nd + 1, now_ms() - t0);
	return 0;
}

static int do_unlinkopen(char **a) {
	int fd = open(a[0], O_RDWR);
	if (fd < 0)
		return fail();
	if (unlink(a[0]) < 0)
		return fail();
	struct stat st;
	const char *gone = stat(a[0], &st) < 0 ? ename(errno) : "exists";
	char buf[256];
	ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
	if (n < 0) {
		printf("stat=%s read=%s\n", gone, ename(errno));
		return 0;
	}
	buf[n] = 0;
	for (ssize_t i = 0; i < n; i++)
		if (buf[i] == '\n')
			buf[i] = '|';
	const char more[] = "+more";
	if (pwrite(fd, more, sizeof more - 1, n) != (ssize_t)(sizeof more - 1)) {
		printf("stat=%s read=%s write=%s\n", gone, buf, ename(errno));
		return 0;
	}
	char buf2[256];
	ssize_t m = pread(fd, buf2, sizeof buf2 - 1, 0);
	if (m < 0) {
		printf("stat=%s read=%s write=ok reread=%s\n", gone, buf, ename(errno));
		return 0;
	}
	buf2[m] = 0;
	for (ssize_t i = 0; i < m; i++)
		if (buf2[i] == '\n')
			buf2[i] = '|';
	if (fstat(fd, &st) < 0) {
		printf("stat=%s read=%s write=ok reread=%s fstat=%s\n", gone, buf, buf2, ename(errno));
		return 0;
	}
	printf("stat=%s read=%s reread=%s nlink=%ld size=%lld\n", gone, buf, buf2, (long)st.st_nlink,
	       (long long)st.st_size);
	close(fd);
	return 0;
}

static int do_fifo(char **a) {
	int fd = open(a[0], O_RDWR | O_NONBLOCK);
	if (fd < 0)
		return fail();
	struct stat st;
	if (fstat(fd, &st) < 0)
		return fail();
	if (write(fd, "ping", 4) != 4)
		return fail();
	char buf[8] = {0};
	ssize_t n = read(fd, buf, sizeof buf - 1);
	if (n < 0)
		return fail();
	printf("fifo=%d read=%s\n", S_ISFIFO(st.st_mode) ? 1 : 0, buf);
	close(fd);
	return 0;
}

static int do_chr(char **a) {
	int fd = open(a[0], O_RDWR);
	if (fd < 0)
		return fail();
	struct stat st;
	if (fstat(fd, &st) < 0)
		return fail();
	long want = num(a[1]);
	char buf[4096];
	memset(buf, 0xff, sizeof buf);
	if (want > (long)sizeof buf)
		want = sizeof buf;
	ssize_t n = read(fd, buf, want);
	if (n < 0)
		return fail();
	int zero = 1;
	for (ssize_t i = 0; i < n; i++)
		zero &= buf[i] == 0;
	ssize_t w = write(fd, "x", 1);
	printf("chr=%d bytes=%zd zero=%d write=%s\n", S_ISCHR(st.st_mode) ? 1 : 0, n, zero,
	       w == 1 ? "ok" : ename(errno));
	close(fd);
	return 0;
}

static int do_ftrunc(char **a) {
	int fd = open(a[0], O_RDWR);
	if (fd < 0)
		return fail();
	if (ftruncate(fd, num(a[1])) < 0)
		return fail();
	printf("ok\n");
	return 0;
}

static int do_fsyncdir(char **a) {
	int fd = open(a[0], O_RDONLY | O_DIRECTORY);
	if (fd < 0)
		return fail();
	if (fsync(fd) < 0)
		return fail();
	printf("ok\n");
	return 0;
}

static int do_mmap(char **a) {
	int wr = !strcmp(a[1], "write");
	int shared = wr || !strcmp(a[1], "shared");
	int fd = open(a[0], wr ? O_RDWR : O_RDONLY);
	if (fd < 0)
		return fail();
	char *p = mmap(NULL, 4096, PROT_READ | (wr ? PROT_WRITE : 0), shared ? MAP_SHARED : MAP_PRIVATE, fd, 0);
	if (p == MAP_FAILED)
		return fail();
	if (wr) {
		memcpy(p, "MMAP!", 5);
		if (msync(p, 4096, MS_SYNC) < 0)
			return fail();
		printf("ok\n");
		return 0;
	}
	printf("ok:%.5s\n", p);
	return 0;
}

static int do_daxattr(char **a) {
	struct statx sx;
	memset(&sx, 0, sizeof sx);
	if (statx(AT_FDCWD, a[0], 0, STATX_BASIC_STATS, &sx) < 0)
		return fail();
#ifndef STATX_ATTR_DAX
#define STATX_ATTR_DAX 0x00200000
#endif
	printf("dax=%d known=%d size=%llu\n", (sx.stx_attributes & STATX_ATTR_DAX) ? 1 : 0,
	       (sx.stx_attributes_mask & STATX_ATTR_DAX) ? 1 : 0, (unsigned long long)sx.stx_size);
	return 0;
}

static sigjmp_buf mapsh_jmp;
static void mapsh_fault(int sig) { siglongjmp(mapsh_jmp, sig); }

static int do_mapsh(char **a) {
	int fd = open(a[0], O_RDWR);
	if (fd < 0)
		return fail();
	struct stat st;
	if (fstat(fd, &st) < 0)
		return fail();
	size_t len = st.st_size > 4096 ? (size_t)st.st_size : 4096;
	volatile char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return fail();
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = mapsh_fault;
	sigaction(SIGBUS, &sa, NULL);
	sigaction(SIGSEGV, &sa, NULL);
	int sig = sigsetjmp(mapsh_jmp, 1);
	if (sig == 0) {
		unsigned sum = 0;
		for (size_t i = 0; i < (size_t)st.st_size; i += 4096)
			sum += p[i];
		printf("mapped size=%zu sum=%u\n", (size_t)st.st_size, sum & 0xff);
	} else {
		printf("%s\n", sig == SIGBUS ? "SIGBUS" : "SIGSEGV");
	}
	char line[4096];
	while (fgets(line, sizeof line, stdin)) {
		line[strcspn(line, "\n")] = 0;
		char op = line[0];
		char *rest = line[0] ? line + 1 : line;
		long long off = strtoll(rest, &rest, 0);
		if (*rest == ' ')
			rest++;
		if (op != 's' && op != 'q' && (off < 0 || (size_t)off >= len)) {
			printf("EINVAL\n");
			continue;
		}
		if ((sig = sigsetjmp(mapsh_jmp, 1)) != 0) {
			printf("%s\n", sig == SIGBUS ? "SIGBUS" : "SIGSEGV");
			continue;
		}
		switch (op) {
		case 'r': {
			long long n = strtoll(rest, NULL, 0);
			if (n < 0 || n > 1024 || (size_t)(off + n) > len) {
				printf("EINVAL\n");
				break;
			}
			char buf[1025];
			for (long long i = 0; i < n; i++)
				buf[i] = p[off + i];
			printf("r:%.*s\n", (int)n, buf);
			break;
		}
		case 'w': {
			size_t n = strlen(rest);
			if ((size_t)off + n > len) {
				printf("EINVAL\n");
				break;
			}
			for (size_t i = 0; i < n; i++)
				p[off + i] = rest[i];
			printf("ok\n");
			break;
		}
		case 's':
			if (msync((void *)p, len, MS_SYNC) < 0)
				printf("%s\n", ename(errno));
			else
				printf("ok\n");
			break;
		case 'p': {
			char *text = rest;
			char *sp = strrchr(text, ' ');
			if (!sp) {
				printf("EINVAL\n");
				break;
			}
			*sp = 0;
			long long ms = strtoll(sp + 1, NULL, 0);
			size_t n = strlen(text);
			if ((size_t)off + n > len || n > 1024) {
				printf("EINVAL\n");
				break;
			}
			long long t0 = now_ms();
			for (;;) {
				size_t i = 0;
				while (i < n && p[off + i] == text[i])
					i++;
				if (i == n) {
					printf("seen ms=%lld\n", now_ms() - t0);
					break;
				}
				if (now_ms() - t0 > ms) {
					char buf[1025];
					for (size_t k = 0; k < n; k++)
						buf[k] = p[off + k];
					printf("timeout r:%.*s\n", (int)n, buf);
					break;
				}
				usleep(10000);
			}
			break;
		}
		case 'q':
			munmap((void *)p, len);
			printf("bye\n");
			return 0;
		default:
			printf("EINVAL\n");
		}
	}
	return 0;
}

static int do_try(char **a, int n) {
	const char *op = a[0];
	int r;
	if (!strcmp(op, "mkdir"))
		r = mkdir(a[1], 0755);
	else if (!strcmp(op, "rmdir"))
		r = rmdir(a[1]);
	else if (!strcmp(op, "unlink"))
		r = unlink(a[1]);
	else if (!strcmp(op, "open") || !strcmp(op, "openw") || !strcmp(op, "opendir")) {
		int flags = !strcmp(op, "open") ? O_RDONLY : !strcmp(op, "openw") ? O_WRONLY : O_RDONLY | O_DIRECTORY;
		r = open(a[1], flags);
		if (r >= 0)
			close(r), r = 0;
	} else if (!strcmp(op, "rename") && n > 2)
		r = rename(a[1], a[2]);
	else if (!strcmp(op, "link") && n > 2)
		r = link(a[1], a[2]);
	else if (!strcmp(op, "symlink") && n > 2)
		r = symlink(a[1], a[2]);
	else if (!strcmp(op, "readlink")) {
		char buf[4096];
		r = readlink(a[1], buf, sizeof buf) < 0 ? -1 : 0;
	} else if (!strcmp(op, "truncate"))
		r = truncate(a[1], 0);
	else
		return usage();
	if (r < 0)
		return fail();
	printf("ok\n");
	return 0;
}

static int do_mtime(char **a) {
	struct stat st;
	if (stat(a[0], &st) < 0)
		return fail();
	printf("mtime=%lld atime=%lld\n", (long long)st.st_mtime, (long long)st.st_atime);
	return 0;
}

static int do_lstatlist(char **a) {
	FILE *f = fopen(a[0], "r");
	if (!f)
		return fail();
	char *line = NULL;
	size_t cap = 0;
	ssize_t len;
	long long ok = 0, bad = 0;
	struct stat st;
	while ((len = getline(&line, &cap, f)) > 0) {
		if (line[len - 1] == '\n')
			line[len - 1] = 0;
		if (lstat(line, &st) == 0) {
			ok++;
		} else {
			bad++;
			fprintf(stderr, "fsops: lstat %s: %s\n", line, strerror(errno));
		}
	}
	free(line);
	fclose(f);
	printf("stat=%lld errors=%lld\n", ok, bad);
	return 0;
}

int main(int argc, char **argv) {
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc < 2)
		return usage();
	const char *c = argv[1];
	char **a = argv + 2;
	int n = argc - 2;
#define CMD(name, nargs, call)                                                                     \
	if (!strcmp(c, name)) {                                                                    \
		if (n < nargs)                                                                     \
			return usage();                                                            \
		return call;                                                                       \
	}
	CMD("excl", 1, do_excl(a));
	CMD("rename2", 3, do_rename2(a));
	CMD("seek", 3, do_seek(a));
	CMD("falloc", 4, do_falloc(a));
	CMD("copy", 5, do_copy(a));
	CMD("copyonce", 3, do_copyonce(a));
	CMD("idmap", 3, do_idmap(a));
	CMD("syncfs", 1, do_syncfs(a));
	CMD("fsync", 1, do_fsync(a));
	CMD("tmpfile", 3, do_tmpfile(a));
	CMD("setx", 3, do_setx(a, n, 0));
	CMD("lsetx", 3, do_setx(a, n, 1));
	CMD("getx", 2, do_getx(a, 0));
	CMD("lgetx", 2, do_getx(a, 1));
	CMD("getxsmall", 2, do_getxsmall(a));
	CMD("listx", 1, do_listx(a, 0));
	CMD("llistx", 1, do_listx(a, 1));
	CMD("rmx", 2, do_rmx(a));
	CMD("statx", 1, do_statx(a));
	CMD("mkmany", 2, do_mkmany(a));
	CMD("count", 1, do_count(a));
	CMD("unlinkopen", 1, do_unlinkopen(a));
	CMD("fifo", 1, do_fifo(a));
	CMD("chr", 2, do_chr(a));
	CMD("mtime", 1, do_mtime(a));
	CMD("lstatlist", 1, do_lstatlist(a));
	CMD("ftrunc", 2, do_ftrunc(a));
	CMD("fsyncdir", 1, do_fsyncdir(a));
	CMD("mmap", 2, do_mmap(a));
	CMD("try", 2, do_try(a, n));
	CMD("daxattr", 1, do_daxattr(a));
	CMD("mapsh", 1, do_mapsh(a));
	CMD("churn", 3, do_churn(a));
	if (!strcmp(c, "asuser")) {
		if (n < 3)
			return usage();
		if (setgroups(0, NULL) < 0 || setgid(num(a[1])) < 0 || setuid(num(a[0])) < 0) {
			perror("fsops asuser");
			return 126;
		}
		execvp(a[2], a + 2);
		perror("fsops asuser: exec");
		return 127;
	}
	if (!strcmp(c, "gen")) {
		if (n < 2)
			return usage();
		uint64_t x = (uint64_t)num(a[0]) * 0x9E3779B97F4A7C15ULL + 1;
		long long left = num(a[1]);
		unsigned char buf[8192];
		while (left > 0) {
			size_t k = left < (long long)sizeof buf ? (size_t)left : sizeof buf;
			for (size_t i = 0; i < k; i += 8) {
				x ^= x >> 12;
				x ^= x << 25;
				x ^= x >> 27;
				uint64_t v = x * 0x2545F4914F6CDD1DULL;
				memcpy(buf + i, &v, k - i < 8 ? k - i : 8);
			}
			if (fwrite(buf, 1, k, stdout) != k)
				return 1;
			left -= k;
		}
		return 0;
	}
	if (!strcmp(c, "now")) {
		printf("%lld\n", now_ms());
		return 0;
	}
	return usage();
}
